/** Wire types of scriptgate-protocol(7), version 1, with their wire (snake_case) names. */

import type { ToolClass } from "./snapshot.js";

export const PROTOCOL_VERSION = 1;

/** `script.start` params. */
export interface StartParams {
  token: string;
  /** The Python source of the script. */
  code: string;
  /** The write tools the script will call (declared up front; approved once). */
  tools?: string[];
  /** What the script does, in a sentence; shown in the approval request. */
  description?: string;
  /**
   * W3C trace context of the span that starts the script (protocol: SPEC §4). Set by
   * the client itself when `@opentelemetry/api` is installed; give it only to
   * override that.
   */
  traceparent?: string;
  tracestate?: string;
}

export interface StartResult {
  script_id: string;
  state: "running";
}

/** Why a script ended (result `status`). */
export type ScriptStatus = "ok" | "error" | "timeout" | "cancelled" | "oom" | "limit" | "interrupted";

export interface Progress {
  done: number;
  total: number;
  message: string;
}

/** `script.status` answer and `script.progress` params. */
export interface ScriptState {
  script_id: string;
  /** `running`, or the final status of a finished script. */
  state: "running" | ScriptStatus;
  calls: number;
  failures: number;
  elapsed_ms: number;
  progress: Progress | null;
}

/** The result object (`script.wait` answer, `script.finished` params). */
export interface ScriptResult {
  script_id: string;
  run_id: string;
  status: ScriptStatus;
  exit_code: number | null;
  calls: number;
  failures: number;
  duration_ms: number;
  details_dir: string;
  output: string;
  output_truncated: boolean;
  error: string | null;
  /** Exactly what goes back to the model. */
  text: string;
  /** Extension: present when the limit backend measures it. */
  memory_peak_bytes?: number;
  /** Extension: present when the limit backend measures it. */
  cpu_usec?: number;
  /** Extension: limits of this script that were not in force (one line each). */
  backend_notes?: string[];
  /** Extension: the parts of the record the daemon could not write, each with why. */
  record_incomplete?: string[];
}

export interface CancelResult {
  script_id: string;
  state: "running" | ScriptStatus;
  /** The script had finished before the cancel: left as it was. */
  already_finished?: boolean;
}

export interface RevokeResult {
  run_id: string;
  cancelled: number;
}

/** `daemon.info`'s `limits`: the configured limits of every script. */
export interface DaemonLimits {
  max_calls: number;
  max_concurrency: number;
  timeout_s: number;
  memory_max_bytes: number;
  tasks_max: number;
  output_max_bytes: number;
  return_max_chars: number;
  approval_timeout_s: number;
  max_running: number;
  [key: string]: number;
}

/** `daemon.info`'s `sandbox` (extension): what the start-up preflight found. */
export interface SandboxInfo {
  /** `ok`, `unavailable` (scripts will fail: `problem` says why and the fix) or `unchecked`. */
  state: "ok" | "unavailable" | "unchecked";
  nested_userns: "disable-userns" | "seccomp";
  problem: string | null;
  detail: string | null;
}

/** `daemon.info`'s `disk` (extension): `scripts.disk_max_bytes` and where it is in force. */
export interface DiskInfo {
  max_bytes: number;
  roots: { root: string; in_force: boolean; why: string | null }[];
}

/** The answer of `daemon.info`. */
export interface DaemonInfo {
  version: string;
  protocol: number;
  backend: string;
  backend_notes: string[];
  running: number;
  limits: DaemonLimits;
  /** Extensions. */
  limits_per_script?: boolean;
  limits_enforced?: boolean;
  sandbox?: SandboxInfo;
  same_uid?: string[];
  disk?: DiskInfo;
  [key: string]: unknown;
}

/** `tool.call` params: one call from a script, for the engine to execute. */
export interface ToolCall {
  script_id: string;
  run_id: string;
  /** Unique within the script. */
  call_id: string;
  tool: string;
  /**
   * The script's arguments with the frozen ones merged in, every number exactly as
   * the script wrote it: an integer outside `Number.MAX_SAFE_INTEGER` (2^53 - 1,
   * up to the 64 bits the daemon passes) is a `bigint`, any other number a
   * `number`. `JSON.stringify` throws on a `bigint`: pass the arguments on with
   * {@link stringifyJson}, or convert them as the tool needs.
   */
  arguments: { [key: string]: unknown };
  /** With a `traceparent` at `script.start`: `00-<trace id>-<the start's span id>-<flags>`. */
  traceparent?: string;
  tracestate?: string;
  /** With a `traceparent` at `script.start`: this call's span id (16 hex), also in calls.jsonl. */
  span_id?: string;
}

/** `tool.cancelled` params: the daemon no longer wants the answer to its request `id`. */
export interface ToolCancelled {
  /** The JSON-RPC id of the `tool.call` request. */
  id: number | string;
  script_id: string;
  call_id: string;
  /** `cancelled`, `timeout`, `oom`, `interrupted` or `exited`. */
  reason: string;
  message: string;
}

/** The plain answer to a `tool.call`: exactly these keys (structured may be left out). */
export interface ToolResult {
  text: string;
  structured?: unknown;
  is_error: boolean;
}

/** One content block of an MCP `CallToolResult`: a string `type`, anything else. */
export interface McpContent {
  type: string;
  [key: string]: unknown;
}

/**
 * An MCP `tools/call` result (what the MCP SDK's `callTool()` resolves to), which the
 * daemon converts as `scriptgate run` does. Other keys are allowed and ignored.
 */
export interface CallToolResult {
  content: McpContent[];
  structuredContent?: { [key: string]: unknown } | null;
  isError?: boolean | null;
  _meta?: { [key: string]: unknown } | null;
  [key: string]: unknown;
}

/**
 * The MCP 2024-10-07 result (`{toolResult}`), the other half of the SDK's `callTool()`
 * return type: the client converts it to `{text, structured, is_error: false}` (text:
 * the value if a string, else its JSON; structured: the value if an object).
 */
export interface CompatibilityCallToolResult {
  toolResult: unknown;
  _meta?: { [key: string]: unknown } | null;
  [key: string]: unknown;
}

/**
 * What a tool handler may answer: a {@link ToolResult}, an MCP result as the SDK gives
 * it, or a string (the text of a successful result). The client checks the answer
 * before sending it (see the README).
 */
export type ToolAnswer = ToolResult | CallToolResult | CompatibilityCallToolResult | string;

/** The MCP `Tool` definition of `run_script` (`run.describe`'s `tool`). */
export interface RunScriptTool {
  name: string;
  description: string;
  inputSchema: { type: "object"; properties?: { [key: string]: unknown }; required?: string[]; [key: string]: unknown };
  [key: string]: unknown;
}

/** The answer of `run.describe`. */
export interface DescribeResult {
  text: string;
  /** Daemons with SPEC §3 (issue 20) only. */
  tool?: RunScriptTool;
}

/** `approval.request` params. */
export interface ApprovalRequest {
  script_id: string;
  run_id: string;
  description: string;
  code: string;
  tools: { name: string; class: ToolClass }[];
  /** The script's trace, when it was started with one (as in {@link ToolCall}). */
  traceparent?: string;
  tracestate?: string;
}

/** What an approval handler may answer; `true` is `allow_once`, `false` is `deny`. */
export type ApprovalDecision = "allow_once" | "deny" | boolean;
