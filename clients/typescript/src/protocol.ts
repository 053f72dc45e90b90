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
}

export interface CancelResult {
  script_id: string;
  state: "running" | ScriptStatus;
}

export interface RevokeResult {
  run_id: string;
  cancelled: number;
}

export interface DaemonInfo {
  version: string;
  protocol: number;
  backend: string;
  backend_notes?: unknown;
  running?: number;
  limits: { [key: string]: unknown };
  [key: string]: unknown;
}

/** `tool.call` params: one call from a script, for the engine to execute. */
export interface ToolCall {
  script_id: string;
  run_id: string;
  /** Unique within the script. */
  call_id: string;
  tool: string;
  /** The script's arguments with the frozen ones merged in. */
  arguments: { [key: string]: unknown };
}

/** The plain answer to a `tool.call`. */
export interface ToolResult {
  text: string;
  structured: unknown | null;
  is_error: boolean;
}

/** One content item of an MCP `CallToolResult`. */
export interface McpContent {
  type: string;
  [key: string]: unknown;
}

/** An MCP `tools/call` result, which the daemon converts as the CLI does. */
export interface CallToolResult {
  content: McpContent[];
  structuredContent?: { [key: string]: unknown };
  isError?: boolean;
  [key: string]: unknown;
}

/** What a tool handler may answer. */
export type ToolAnswer = ToolResult | CallToolResult;

/** `approval.request` params. */
export interface ApprovalRequest {
  script_id: string;
  run_id: string;
  description: string;
  code: string;
  tools: { name: string; class: ToolClass }[];
}

/** What an approval handler may answer; `true` is `allow_once`, `false` is `deny`. */
export type ApprovalDecision = "allow_once" | "deny" | boolean;
