import { EventEmitter } from "node:events";
import { connect as netConnect } from "node:net";
import type { Duplex } from "node:stream";
import { inspect } from "node:util";
import {
  ApprovalError,
  CallCancelledError,
  ConnectionClosedError,
  DaemonError,
  ErrorCode,
  NotFoundError,
  ProtocolError,
  ScriptgateError,
  connectError,
  type RpcErrorObject,
} from "./errors.js";
import { parseJson, stringifyJson } from "./json.js";
import { SPAN_ERROR, SPAN_OK, formatTraceparent, loadOtel, parseTraceparent, type OtelApi, type OtelSpan } from "./otel.js";
import type {
  ApprovalDecision,
  ApprovalRequest,
  CancelResult,
  DaemonInfo,
  DescribeResult,
  RevokeResult,
  RunScriptTool,
  ScriptResult,
  ScriptState,
  StartParams,
  StartResult,
  ToolAnswer,
  ToolCall,
  ToolCancelled,
} from "./protocol.js";

/** The default socket of a packaged daemon (`scriptgate.socket`), used when `SCRIPTGATE_SOCKET` is not set. */
export const DEFAULT_SOCKET = "/run/scriptgate/scriptgate.sock";

/** The daemon's default `server.max_message_bytes`. */
export const DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024;

/** Progress a tool handler reports (the MCP SDK's `onprogress` argument is one). */
export interface HandlerProgress {
  progress: number;
  total?: number | undefined;
  message?: string | undefined;
}

export interface ToolCallContext {
  /**
   * This call's own signal. Aborted when the daemon sends `tool.cancelled` for it
   * (the script was cancelled, timed out, ...), when the script finishes, when the
   * connection closes, and at `toolTimeoutMs`; `signal.reason` is a
   * {@link CallCancelledError} saying which.
   */
  signal: AbortSignal;
  /** Report progress: a `type: "call"` event of {@link ScriptgateClient.progress} and `callProgress`. */
  progress(progress: number, total?: number, message?: string): void;
  /**
   * `{signal, onprogress}`: pass it as the MCP SDK's `RequestOptions` (`callTool(params,
   * undefined, context.requestOptions)`) so the MCP call is aborted with this call and
   * its progress notifications reach {@link ToolCallContext.progress}.
   */
  requestOptions: { signal: AbortSignal; onprogress: (p: HandlerProgress) => void };
}

export type ToolHandler = (call: ToolCall, context: ToolCallContext) => ToolAnswer | Promise<ToolAnswer>;
export type ApprovalHandler = (request: ApprovalRequest) => ApprovalDecision | Promise<ApprovalDecision>;

export interface ClientOptions {
  /** Serves `tool.call`. Without one, calls are answered with a JSON-RPC error. */
  onToolCall?: ToolHandler;
  /** Serves `approval.request`. Without one, every approval is denied (with a warning). */
  onApproval?: ApprovalHandler;
  /**
   * A tool handler that has not answered after this many milliseconds: its signal
   * aborts (reason `handler_timeout`) and the call is answered with an error naming
   * the timeout. Default: none (the script's `timeout_s` bounds it).
   */
  toolTimeoutMs?: number;
  /** An approval handler that has not answered after this many milliseconds: denied, with a warning. */
  approvalTimeoutMs?: number;
  /**
   * Longest line accepted from the daemon, in bytes (default 16 MiB, the daemon's own
   * default). A longer one closes the connection: nothing unbounded is buffered.
   */
  maxLineBytes?: number;
  /**
   * OpenTelemetry: `true` (default) imports `@opentelemetry/api` when it is installed;
   * `false` traces nothing; or pass the API module itself.
   */
  tracing?: boolean | OtelApi;
  /** The socket's path, for error messages (set by {@link ScriptgateClient.connect}). */
  path?: string;
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
  /** Give up after this many seconds: {@link StillRunningError} (-32017); the script goes on. */
  timeoutS?: number;
}

export interface RunOptions {
  /**
   * When it aborts, the script is cancelled (`script.cancel`) and `run` resolves with
   * the cancelled result (status `cancelled`). Aborted before the script started: `run`
   * rejects with the signal's reason and starts nothing.
   */
  signal?: AbortSignal;
  /** Cancel the script after this many seconds; `run` resolves with the cancelled result. */
  timeoutS?: number;
}

/** A `script.progress` notification (the daemon's), as a progress event. */
export interface ScriptProgressEvent extends ScriptState {
  type: "script";
}

/** Progress a tool handler reported through `context.progress()` (e.g. forwarded MCP progress). */
export interface CallProgressEvent {
  type: "call";
  script_id: string;
  call_id: string;
  tool: string;
  progress: number;
  total: number | null;
  message: string | null;
}

export type ProgressEvent = ScriptProgressEvent | CallProgressEvent;

/** What a handler did wrong (the `handlerError` event): `reason` says what. */
export class HandlerError extends ScriptgateError {
  /** `tool` or `approval`. */
  readonly handler: "tool" | "approval";
  readonly scriptId: string | undefined;
  readonly callId: string | undefined;
  constructor(handler: "tool" | "approval", reason: "malformed_answer" | "threw" | "timeout", message: string, ids: { tool?: string | undefined; scriptId?: string | undefined; callId?: string | undefined }, cause?: unknown) {
    super(ErrorCode.INTERNAL, message, { reason, tool: ids.tool }, handler === "tool" ? "tool.call" : "approval.request", { cause });
    this.handler = handler;
    this.scriptId = ids.scriptId;
    this.callId = ids.callId;
  }
}

interface Pending {
  method: string;
  resolve: (v: unknown) => void;
  reject: (e: unknown) => void;
  /** Runs synchronously as the answer is read, before any later line. */
  onResult?: (v: unknown) => void;
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
  /** A tool handler's `context.progress()`. */
  callProgress: [event: CallProgressEvent];
  /** `script.finished`. */
  finished: [result: ScriptResult];
  /** `tool.cancelled`: the daemon no longer wants that call's answer (its signal has aborted). */
  cancelled: [params: ToolCancelled];
  /** Any notification from the daemon, the ones above included. */
  notification: [method: string, params: unknown];
  /** An error the daemon sent with id null (e.g. -32700, a {@link DaemonError}), or a line that could not be read (a {@link ProtocolError}). */
  protocolError: [error: ScriptgateError];
  /**
   * A handler answered something the daemon would refuse, threw, or timed out. Without
   * a listener, a malformed answer and a timeout are printed with console.error.
   */
  handlerError: [error: HandlerError];
  /** Something the engine should know (an approval denied for want of a handler, ...); without a listener, console.warn. */
  warning: [message: string];
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

/** How a thrown value reaches the model: `TypeError: boom`; an object as JSON. */
export function describeThrown(e: unknown): string {
  if (e instanceof Error) return e.message ? `${e.name}: ${e.message}` : e.name;
  if (typeof e === "string") return e;
  if (e !== null && typeof e === "object") {
    try {
      const j = stringifyJson(e);
      if (j !== undefined && j !== "{}") return j;
    } catch {
      // circular: fall through
    }
    return inspect(e, { depth: 4, breakLength: Infinity });
  }
  return String(e);
}

function errorMessage(e: unknown): string {
  if (e instanceof Error) return e.message || e.name;
  return String(e);
}

const PLAIN_KEYS = ["text", "structured", "is_error"];

/**
 * Check a tool handler's answer as the daemon will (protocol tool.call, SPEC §1) and
 * bring it to a wire shape: the answer to send, or the problem with it.
 */
export function checkToolAnswer(r: unknown): { answer: unknown } | { problem: string } {
  if (typeof r === "string") return { answer: { text: r, structured: null, is_error: false } };
  if (!isObject(r)) {
    const what = r === null ? "null" : Array.isArray(r) ? "an array" : typeof r;
    return { problem: `answered ${what}; expected {text, is_error, structured?}, an MCP CallToolResult ({content: [...]}) or a string` };
  }
  const has = (k: string) => r[k] !== undefined && r[k] !== null;
  if ("content" in r) {
    const c = r["content"];
    if (!Array.isArray(c)) return { problem: "content must be an array of content blocks" };
    for (let i = 0; i < c.length; i++) {
      const b: unknown = c[i];
      if (!isObject(b) || typeof b["type"] !== "string") return { problem: `content[${i}] must be an object with a string \`type\`` };
    }
    if (has("isError") && typeof r["isError"] !== "boolean") return { problem: "isError must be a boolean" };
    if (has("structuredContent") && !isObject(r["structuredContent"])) return { problem: "structuredContent must be an object" };
    if (has("_meta") && !isObject(r["_meta"])) return { problem: "_meta must be an object" };
    const mixed = PLAIN_KEYS.find((k) => k in r);
    if (mixed !== undefined) return { problem: `\`${mixed}\` beside \`content\` mixes the two answer shapes (the daemon refuses it)` };
    return { answer: r };
  }
  if ("toolResult" in r) {
    const v = r["toolResult"];
    let text: string;
    if (typeof v === "string") text = v;
    else {
      try {
        text = stringifyJson(v) ?? "null";
      } catch (e) {
        return { problem: `toolResult cannot be sent as JSON: ${errorMessage(e)}` };
      }
    }
    return { answer: { text, structured: isObject(v) ? v : null, is_error: false } };
  }
  for (const k of Object.keys(r)) {
    if (!PLAIN_KEYS.includes(k)) return { problem: `unknown key \`${k}\` (a plain answer has exactly text, is_error and, optionally, structured; an MCP one has content)` };
  }
  if (typeof r["text"] !== "string") return { problem: "text must be a string" };
  if (typeof r["is_error"] !== "boolean") return { problem: "is_error must be a boolean" };
  return { answer: r };
}

interface CallState {
  key: string;
  call: ToolCall;
  controller: AbortController;
  /** Answered, cancelled or abandoned: nothing more is sent for it. */
  done: boolean;
  timer: ReturnType<typeof setTimeout> | undefined;
  span: OtelSpan | undefined;
}

const END = Symbol("end");
type StreamItem = ProgressEvent | typeof END;

interface Stream {
  history: ProgressEvent[];
  listeners: Set<(item: StreamItem) => void>;
  finished: boolean;
}

/** Progress events kept per script for iterators that attach late. */
const HISTORY_MAX = 1000;
/** Finished scripts whose progress history is kept. */
const FINISHED_KEPT = 64;

const idKey = (id: Id) => `${typeof id}:${String(id)}`;

/**
 * An engine's connection to scriptgated: JSON-RPC 2.0, one message per line, both
 * sides sending requests. Requests from the daemon (`tool.call`,
 * `approval.request`) are served concurrently with everything else: an
 * `approval.request` arrives before the `script.start` answer it gates.
 */
export class ScriptgateClient extends EventEmitter {
  /** The socket's path (as given to connect). */
  readonly path: string;
  private readonly socket: Duplex;
  private readonly maxLineBytes: number;
  private readonly toolTimeoutMs: number | undefined;
  private readonly approvalTimeoutMs: number | undefined;
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  private partial: Buffer[] = [];
  private partialBytes = 0;
  private closedError: Error | undefined;
  private closed = false;
  private closing = false;
  private peerRefusal: ScriptgateError | undefined;
  private readonly calls = new Map<string, CallState>();
  private readonly scriptCalls = new Map<string, Set<CallState>>();
  private readonly streams = new Map<string, Stream>();
  private readonly runSpans = new Map<string, OtelSpan>();
  /** Approvals this client denied on its own (no handler, a timeout, a bad answer), and the last one's why. */
  private denials = 0;
  private lastDenial = "";
  private toolHandler: ToolHandler | undefined;
  private approvalHandler: ApprovalHandler | undefined;
  private readonly otel: Promise<OtelApi | null>;
  private warnedNoToolHandler = false;

  /** Wrap a connected stream; see {@link ScriptgateClient.connect}. */
  constructor(socket: Duplex, options: ClientOptions = {}) {
    super();
    this.socket = socket;
    this.path = options.path ?? "(a stream)";
    this.maxLineBytes = options.maxLineBytes ?? DEFAULT_MAX_LINE_BYTES;
    this.toolTimeoutMs = options.toolTimeoutMs;
    this.approvalTimeoutMs = options.approvalTimeoutMs;
    this.toolHandler = options.onToolCall;
    this.approvalHandler = options.onApproval;
    const t = options.tracing ?? true;
    this.otel = t === false ? Promise.resolve(null) : t === true ? loadOtel() : Promise.resolve(t);
    socket.on("data", (chunk: Buffer) => this.onData(chunk));
    socket.on("error", (e: Error) => {
      this.closedError ??= e;
    });
    socket.on("close", () => this.onClose());
    socket.on("end", () => socket.end());
  }

  /**
   * Connect to the daemon's socket: `path`, else `$SCRIPTGATE_SOCKET`, else
   * {@link DEFAULT_SOCKET}. A failure rejects with a {@link ConnectionError} naming the
   * path: {@link SocketNotFoundError}, {@link ConnectionRefusedError},
   * {@link PermissionDeniedError}.
   */
  static connect(path?: string, options: ClientOptions = {}): Promise<ScriptgateClient> {
    const p = path || process.env["SCRIPTGATE_SOCKET"] || DEFAULT_SOCKET;
    return new Promise((resolve, reject) => {
      const s = netConnect(p);
      const fail = (e: Error) => reject(connectError(p, e));
      s.once("error", fail);
      s.once("connect", () => {
        s.off("error", fail);
        const c = new ScriptgateClient(s, { ...options, path: p });
        // Tracing is looked up before the first start, so start() costs no extra wait.
        void c.otel.then(() => resolve(c));
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

  /**
   * `script.start`: resolves with `{script_id, state: "running"}` once the script runs
   * (after its approval, if one is needed). With OpenTelemetry, opens the span
   * `scriptgate.run_script` (ended when the script finishes) and sends its
   * `traceparent`.
   */
  async start(params: StartParams): Promise<StartResult> {
    const p: StartParams = { token: params.token, code: params.code, tools: params.tools ?? [] };
    p.description = params.description ?? "";
    if (params.traceparent !== undefined) p.traceparent = params.traceparent;
    if (params.tracestate !== undefined) p.tracestate = params.tracestate;
    const api = await this.otel;
    let span: OtelSpan | undefined;
    if (api && p.traceparent === undefined) {
      span = api.trace.getTracer("@scriptgate/client").startSpan("scriptgate.run_script", {}, api.context.active());
      const sc = span.spanContext();
      const tp = formatTraceparent(api, sc);
      if (tp) {
        p.traceparent = tp;
        const ts = sc.traceState?.serialize();
        if (ts) p.tracestate = ts;
      }
    }
    const denials = this.denials;
    try {
      return (await this.request("script.start", p, (r) => {
        if (!isObject(r) || typeof r["script_id"] !== "string") return;
        const id = r["script_id"];
        this.streams.set(id, { history: [], listeners: new Set(), finished: false });
        if (span) {
          span.setAttribute("scriptgate.script_id", id);
          this.runSpans.set(id, span);
        }
      })) as StartResult;
    } catch (e) {
      if (span) {
        span.recordException(e as Error);
        span.setStatus({ code: SPAN_ERROR, message: errorMessage(e) });
        span.end();
      }
      if (e instanceof ApprovalError && e.reason === "denied" && this.denials > denials) {
        throw new ApprovalError(`${e.message}: ${this.lastDenial}`, e.data, e.method);
      }
      throw e;
    }
  }

  /** `script.wait`: the result object once the script has finished. */
  wait(scriptId: string, options: WaitOptions = {}): Promise<ScriptResult> {
    const p = this.ref(scriptId, options);
    if (options.timeoutS !== undefined) p["timeout_s"] = options.timeoutS;
    return this.request("script.wait", p) as Promise<ScriptResult>;
  }

  /**
   * `script.start`, then `script.wait`. `signal` or `timeoutS` cancel the script
   * (`script.cancel`); `run` then resolves with its cancelled result.
   */
  async run(params: StartParams, options: RunOptions = {}): Promise<ScriptResult> {
    const { signal, timeoutS } = options;
    signal?.throwIfAborted();
    const { script_id } = await this.start(params);
    let timer: ReturnType<typeof setTimeout> | undefined;
    let cancelling: Promise<unknown> | undefined;
    const cancel = () => {
      cancelling ??= this.cancel(script_id).catch(() => undefined);
    };
    signal?.addEventListener("abort", cancel, { once: true });
    if (signal?.aborted) cancel();
    if (timeoutS !== undefined) timer = setTimeout(cancel, timeoutS * 1000);
    try {
      return await this.wait(script_id);
    } finally {
      signal?.removeEventListener("abort", cancel);
      if (timer) clearTimeout(timer);
    }
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

  /** `run.describe`: the `run_script` tool description (text) for the token's snapshot. */
  async describe(token: string): Promise<string> {
    const r = (await this.request("run.describe", { token })) as DescribeResult;
    return r.text;
  }

  /**
   * `run.describe`'s `tool`: the MCP `Tool` definition of `run_script` for the token's
   * snapshot, to hand the model as it is. Its arguments are `start()`'s `code`,
   * `tools`, `description`. Rejects when the daemon predates it.
   */
  async runScriptTool(token: string): Promise<RunScriptTool> {
    const r = (await this.request("run.describe", { token })) as DescribeResult;
    if (!isObject(r) || !isObject(r.tool)) {
      throw new ProtocolError("run.describe answered no `tool`: this scriptgated predates the run_script tool definition", r);
    }
    return r.tool;
  }

  /** `daemon.info` (it takes no params, and none are sent). */
  info(): Promise<DaemonInfo> {
    return this.request("daemon.info") as Promise<DaemonInfo>;
  }

  /**
   * The progress of a script this connection started, as an async iterator: the
   * daemon's `script.progress` (`type: "script"`) and the tool handlers'
   * `context.progress()` (`type: "call"`, naming the call and the tool), in arrival
   * order, from the script's start (up to the last 1000 events) on. It ends after
   * `script.finished` (and when the connection closes). Throws {@link NotFoundError}
   * for a script this connection did not start (or one of more than 64 finished since).
   */
  progress(scriptId: string): AsyncIterableIterator<ProgressEvent> {
    const st = this.streams.get(scriptId);
    if (!st) throw new NotFoundError(`script ${scriptId} was not started on this connection (or finished long ago): no progress to follow`);
    const queue: ProgressEvent[] = [...st.history];
    let ended = st.finished;
    let wake: (() => void) | undefined;
    const listener = (item: StreamItem) => {
      if (item === END) ended = true;
      else queue.push(item);
      wake?.();
    };
    if (!ended) st.listeners.add(listener);
    const stop = () => {
      st.listeners.delete(listener);
      ended = true;
      queue.length = 0;
      wake?.();
    };
    const it: AsyncIterableIterator<ProgressEvent> = {
      [Symbol.asyncIterator]: () => it,
      async next(): Promise<IteratorResult<ProgressEvent>> {
        for (;;) {
          const ev = queue.shift();
          if (ev) return { value: ev, done: false };
          if (ended) {
            st.listeners.delete(listener);
            return { value: undefined, done: true };
          }
          await new Promise<void>((r) => (wake = r));
          wake = undefined;
        }
      },
      async return(): Promise<IteratorResult<ProgressEvent>> {
        stop();
        return { value: undefined, done: true };
      },
    };
    return it;
  }

  /**
   * Send any request (e.g. the `admin.*` extension) and resolve with its result;
   * an error answer rejects with a {@link DaemonError} (the subclass of its code).
   * `params` left out (undefined) are not sent.
   */
  request(method: string, params?: unknown, onResult?: (result: unknown) => void): Promise<unknown> {
    if (this.closed || this.closing) {
      return Promise.reject(this.closeReason(`connection closed; ${method} not sent`));
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      const p: Pending = { method, resolve, reject };
      if (onResult) p.onResult = onResult;
      this.pending.set(id, p);
      if (!this.send(params === undefined ? { jsonrpc: "2.0", id, method } : { jsonrpc: "2.0", id, method, params })) {
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

  private warn(message: string): void {
    if (this.listenerCount("warning") > 0) this.emitSafely("warning", message);
    else console.warn(`scriptgate: ${message}`);
  }

  private handlerError(e: HandlerError, printAlone: boolean): void {
    if (this.listenerCount("handlerError") > 0) this.emitSafely("handlerError", e);
    else if (printAlone) console.error(`scriptgate: ${e.message}`);
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
    this.closedError ??= new ProtocolError(`the daemon at ${this.path} sent a line longer than maxLineBytes (${this.maxLineBytes}); connection closed`);
    this.socket.destroy();
  }

  private onLine(line: Buffer): void {
    const text = line.toString("utf8").trim();
    if (text === "") return;
    let msg: Message;
    try {
      // Integers past 2^53 - 1 as exact bigints (json.ts): JSON.parse would round them.
      const v: unknown = parseJson(text);
      if (!isObject(v)) throw new Error("not a JSON object");
      msg = v as Message;
    } catch (e) {
      this.emitSafely("protocolError", new ProtocolError(`unreadable line from the daemon: ${errorMessage(e)}`, undefined, { cause: e }));
      return;
    }
    if (typeof msg.method === "string") {
      if (msg.id !== undefined && msg.id !== null) this.serve(msg.id, msg.method, msg.params);
      else this.onNotification(msg.method, msg.params);
      return;
    }
    if (msg.id === undefined || msg.id === null) {
      const err = isObject(msg.error) ? ScriptgateError.fromRpc(msg.error) : new ProtocolError("message without id or method");
      // An error with id null (a refused peer, a line too long, a cap): what the
      // requests still pending fail with when the daemon then closes.
      if (err instanceof DaemonError) this.peerRefusal = err;
      this.emitSafely("protocolError", err);
      return;
    }
    const p = typeof msg.id === "number" ? this.pending.get(msg.id) : undefined;
    if (!p) {
      this.emitSafely("protocolError", new ProtocolError(`answer to unknown request id ${JSON.stringify(msg.id)}`));
      return;
    }
    this.pending.delete(msg.id as number);
    if (msg.error !== undefined) {
      p.reject(isObject(msg.error) ? ScriptgateError.fromRpc(msg.error, p.method) : new ProtocolError(`${p.method} answered a malformed error object: ${describeThrown(msg.error)}`));
      return;
    }
    try {
      p.onResult?.(msg.result);
    } finally {
      p.resolve(msg.result);
    }
  }

  private onNotification(method: string, params: unknown): void {
    const sid = isObject(params) && typeof params["script_id"] === "string" ? params["script_id"] : undefined;
    if (method === "tool.cancelled" && isObject(params)) {
      const id = params["id"];
      const st = typeof id === "number" || typeof id === "string" ? this.calls.get(idKey(id)) : undefined;
      if (st) {
        const reason = typeof params["reason"] === "string" ? params["reason"] : "cancelled";
        const message = typeof params["message"] === "string" ? params["message"] : `call ${st.call.call_id} cancelled by the daemon`;
        this.abandon(st, new CallCancelledError(reason, message, { scriptId: st.call.script_id, callId: st.call.call_id }));
      }
    }
    if (method === "script.finished" && sid !== undefined) {
      for (const st of [...(this.scriptCalls.get(sid) ?? [])]) {
        this.abandon(st, new CallCancelledError("finished", `script ${sid} finished before call ${st.call.call_id} was answered`, { scriptId: sid, callId: st.call.call_id }));
      }
      this.endRunSpan(sid, params as ScriptResult);
    }
    if (method === "script.progress" && sid !== undefined && isObject(params)) {
      this.push(sid, { ...(params as unknown as ScriptState), type: "script" });
    }
    this.emitSafely("notification", method, params);
    if (method === "script.progress") this.emitSafely("progress", params as ScriptState);
    else if (method === "script.finished") this.emitSafely("finished", params as ScriptResult);
    else if (method === "tool.cancelled") this.emitSafely("cancelled", params as ToolCancelled);
    if (method === "script.finished" && sid !== undefined) this.finishStream(sid);
  }

  private push(scriptId: string, ev: ProgressEvent): void {
    const st = this.streams.get(scriptId);
    if (!st || st.finished) return;
    st.history.push(ev);
    if (st.history.length > HISTORY_MAX) st.history.shift();
    for (const l of st.listeners) l(ev);
  }

  private finishStream(scriptId: string): void {
    const st = this.streams.get(scriptId);
    if (!st || st.finished) return;
    st.finished = true;
    for (const l of st.listeners) l(END);
    st.listeners.clear();
    // Keep the finished ones' history for late iterators, a bounded number of them.
    this.streams.delete(scriptId);
    this.streams.set(scriptId, st);
    let finished = 0;
    for (const s of this.streams.values()) if (s.finished) finished++;
    for (const [id, s] of this.streams) {
      if (finished <= FINISHED_KEPT) break;
      if (s.finished) {
        this.streams.delete(id);
        finished--;
      }
    }
  }

  private endRunSpan(scriptId: string, result: ScriptResult | undefined, error?: Error): void {
    const span = this.runSpans.get(scriptId);
    if (!span) return;
    this.runSpans.delete(scriptId);
    if (result && typeof result.status === "string") {
      span.setAttribute("scriptgate.status", result.status);
      if (typeof result.calls === "number") span.setAttribute("scriptgate.calls", result.calls);
      if (typeof result.failures === "number") span.setAttribute("scriptgate.failures", result.failures);
      if (result.status === "ok") span.setStatus({ code: SPAN_OK });
      else span.setStatus({ code: SPAN_ERROR, message: `${result.status}${result.error ? `: ${result.error}` : ""}` });
    } else {
      span.setStatus({ code: SPAN_ERROR, message: error ? errorMessage(error) : "no result" });
    }
    span.end();
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
    if (method === "tool.call") {
      this.serveToolCall(id, params);
      return;
    }
    void Promise.resolve()
      .then(() => (method === "approval.request" ? this.serveApproval(params) : Promise.reject(new ScriptgateError(ErrorCode.METHOD_NOT_FOUND, `method not found: ${method}`))))
      .then(
        (result) => this.answer(id, { result }),
        (e: unknown) => {
          const code = e instanceof ScriptgateError && e.code !== undefined ? e.code : ErrorCode.HANDLER;
          this.answer(id, { error: { code, message: describeThrown(e) } });
        },
      );
  }

  private serveToolCall(id: Id, params: unknown): void {
    const call = (isObject(params) ? params : {}) as unknown as ToolCall;
    const h = this.toolHandler;
    if (!h) {
      if (!this.warnedNoToolHandler) {
        this.warnedNoToolHandler = true;
        this.warn("a tool.call arrived and no tool handler is registered (onToolCall): every call is answered with an error");
      }
      this.answer(id, { error: { code: ErrorCode.METHOD_NOT_FOUND, message: "this engine serves no tool calls (no tool handler registered)" } });
      return;
    }
    const st: CallState = { key: idKey(id), call, controller: new AbortController(), done: false, timer: undefined, span: undefined };
    const ids = { tool: call.tool, scriptId: call.script_id, callId: call.call_id };
    const what = `the tool handler for ${call.tool} (call ${call.call_id} of script ${call.script_id})`;
    this.calls.set(st.key, st);
    let set = this.scriptCalls.get(call.script_id);
    if (!set) this.scriptCalls.set(call.script_id, (set = new Set()));
    set.add(st);
    const finish = (body: { result: unknown } | { error: RpcErrorObject }, failed: boolean) => {
      if (st.done) return;
      st.span?.setStatus(failed ? { code: SPAN_ERROR, message: "error" in body ? body.error.message : "is_error" } : { code: SPAN_OK });
      this.forget(st);
      this.answer(id, body);
    };
    if (this.closed) st.controller.abort(new CallCancelledError("connection_closed", `connection to ${this.path} closed`, ids));
    if (this.toolTimeoutMs !== undefined) {
      const ms = this.toolTimeoutMs;
      st.timer = setTimeout(() => {
        const message = `${what} did not answer within toolTimeoutMs = ${ms} ms`;
        st.controller.abort(new CallCancelledError("handler_timeout", message, ids));
        this.handlerError(new HandlerError("tool", "timeout", message, ids), true);
        finish({ error: { code: ErrorCode.HANDLER, message } }, true);
      }, ms);
    }
    const progress = (p: number, total?: number, message?: string) => {
      if (st.done || typeof p !== "number") return;
      const ev: CallProgressEvent = {
        type: "call",
        script_id: call.script_id,
        call_id: call.call_id,
        tool: call.tool,
        progress: p,
        total: typeof total === "number" ? total : null,
        message: typeof message === "string" ? message : null,
      };
      this.push(call.script_id, ev);
      this.emitSafely("callProgress", ev);
    };
    const signal = st.controller.signal;
    const ctx: ToolCallContext = {
      signal,
      progress,
      requestOptions: { signal, onprogress: (p) => progress(p.progress, p.total, p.message) },
    };
    void this.otel
      .then((api) => {
        if (!api) return h(call, ctx);
        let parent = api.context.active();
        const sc = typeof call.traceparent === "string" ? parseTraceparent(api, call.traceparent, call.tracestate) : undefined;
        if (sc) parent = api.trace.setSpanContext(api.ROOT_CONTEXT, sc);
        const attributes: Record<string, string> = { "scriptgate.tool": call.tool, "scriptgate.script_id": call.script_id, "scriptgate.call_id": call.call_id };
        if (typeof call.span_id === "string") attributes["scriptgate.call.span_id"] = call.span_id;
        const span = api.trace.getTracer("@scriptgate/client").startSpan("scriptgate.tool_call", { attributes }, parent);
        if (st.done) span.end();
        else st.span = span;
        return api.context.with(api.trace.setSpan(parent, span), () => h(call, ctx));
      })
      .then(
        (r: unknown) => {
          if (st.done) return;
          const c = checkToolAnswer(r);
          if ("problem" in c) {
            const message = `${what} ${c.problem.startsWith("answered") ? c.problem : `answered a malformed result: ${c.problem}`}`;
            this.handlerError(new HandlerError("tool", "malformed_answer", message, ids), true);
            finish({ error: { code: ErrorCode.INTERNAL, message } }, true);
          } else {
            const a = c.answer as Record<string, unknown>;
            finish({ result: a }, a["isError"] === true || a["is_error"] === true);
          }
        },
        (e: unknown) => {
          if (st.done) return;
          st.span?.recordException(e instanceof Error ? e : new Error(describeThrown(e)));
          this.handlerError(new HandlerError("tool", "threw", `${what} threw: ${describeThrown(e)}`, ids, e), false);
          finish({ error: { code: ErrorCode.HANDLER, message: describeThrown(e) } }, true);
        },
      );
  }

  /** Nothing more is sent for this call; its signal aborts with `reason`. */
  private abandon(st: CallState, reason: CallCancelledError): void {
    if (st.done) return;
    st.span?.setStatus({ code: SPAN_ERROR, message: `${reason.reason ?? "cancelled"}: ${reason.message}` });
    this.forget(st);
    st.controller.abort(reason);
  }

  private forget(st: CallState): void {
    st.done = true;
    if (st.timer) clearTimeout(st.timer);
    st.span?.end();
    st.span = undefined;
    this.calls.delete(st.key);
    const set = this.scriptCalls.get(st.call.script_id);
    if (set) {
      set.delete(st);
      if (set.size === 0) this.scriptCalls.delete(st.call.script_id);
    }
  }

  private async serveApproval(params: unknown): Promise<{ decision: "allow_once" | "deny" }> {
    const req = (isObject(params) ? params : {}) as unknown as ApprovalRequest;
    const which = `script ${req.script_id} of run ${req.run_id} (${Array.isArray(req.tools) ? req.tools.map((t) => t.name).join(", ") : ""})`;
    const h = this.approvalHandler;
    if (!h) {
      const note = "no approval handler is registered on this client (onApproval)";
      this.denied(note);
      this.warn(`denied the approval of ${which}: ${note}`);
      return { decision: "deny" };
    }
    let timer: ReturnType<typeof setTimeout> | undefined;
    const ms = this.approvalTimeoutMs;
    const timedOut = Symbol("timeout");
    const answer = Promise.resolve().then(() => h(req));
    const d: unknown =
      ms === undefined
        ? await answer
        : await Promise.race([answer, new Promise((r) => (timer = setTimeout(() => r(timedOut), ms)))]).finally(() => clearTimeout(timer));
    if (d === timedOut) {
      answer.catch(() => undefined);
      const note = `the approval handler did not answer within approvalTimeoutMs = ${ms} ms`;
      this.denied(note);
      this.warn(`denied the approval of ${which}: ${note}`);
      return { decision: "deny" };
    }
    if (d === true || d === "allow_once") return { decision: "allow_once" };
    if (d === false || d === "deny") return { decision: "deny" };
    const message = `the approval handler answered ${describeThrown(d)} for ${which}; expected "allow_once", "deny" or a boolean`;
    this.denied(message);
    this.handlerError(new HandlerError("approval", "malformed_answer", message, { scriptId: req.script_id }), true);
    throw new ScriptgateError(ErrorCode.INTERNAL, message);
  }

  private denied(why: string): void {
    this.denials++;
    this.lastDenial = why;
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
      line = stringifyJson(msg) as string;
    } catch {
      return false;
    }
    if (line === undefined) return false;
    if (!this.closed) this.socket.write(line + "\n");
    return true;
  }

  // ---- closing ----------------------------------------------------------------

  private closeReason(what: string): Error {
    return this.peerRefusal ?? new ConnectionClosedError(this.path, `${what} (${this.path})`, { cause: this.closedError });
  }

  private onClose(): void {
    if (this.closed) return;
    this.closed = true;
    const reason = this.closeReason("connection to scriptgated closed");
    for (const p of this.pending.values()) p.reject(reason);
    this.pending.clear();
    for (const st of [...this.calls.values()]) {
      this.abandon(st, new CallCancelledError("connection_closed", `connection to ${this.path} closed`, { scriptId: st.call.script_id, callId: st.call.call_id }, { cause: reason }));
    }
    for (const id of [...this.runSpans.keys()]) this.endRunSpan(id, undefined, reason);
    for (const [id, st] of this.streams) if (!st.finished) this.finishStream(id);
    this.emitSafely("close", this.closing && !this.closedError ? undefined : (this.peerRefusal ?? this.closedError ?? reason));
  }
}
