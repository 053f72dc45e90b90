import { isAbsolute } from "node:path";
import { SnapshotError } from "./errors.js";

/** How a tool may be used from a script (protocol §3). */
export type ToolClass = "read" | "write" | "destructive" | "long_task";
export type PermissionMode = "approval" | "auto";

/** A JSON Schema (draft 2020-12): an object, or a boolean schema. */
export type JsonSchema = { [key: string]: unknown } | boolean;

/** One tool of the snapshot. */
export interface ToolSpec {
  name: string;
  class: ToolClass;
  /** Default true; a disabled tool is not provided to the script at all. */
  enabled?: boolean;
  /**
   * Required for enabled `read` and `write` tools (the daemon refuses the snapshot
   * without it: -32011 missing_field). Object schemas are taken as closed: keys the
   * schema does not declare are refused, unless it says `additionalProperties: true`.
   */
  input_schema?: JsonSchema;
  /** Arguments bound by the engine; the script must not pass them. */
  frozen?: { [key: string]: unknown };
  /** What the model reads about the tool (`run.describe` shows it under the signature). */
  description?: string;
  // An MCP `Tool`'s own keys, which the daemon refuses (unknown_field): typed `never`
  // so that `{...mcpTool, class: "read"}` does not compile. Use toolFromMcp().
  inputSchema?: never;
  outputSchema?: never;
  annotations?: never;
  execution?: never;
  title?: never;
  icons?: never;
  _meta?: never;
}

/** Optional per-run limits; each can only tighten the daemon's configured value. */
export interface SnapshotLimits {
  max_calls?: number;
  max_concurrency?: number;
  timeout_s?: number;
  memory_max_bytes?: number;
  tasks_max?: number;
}

/** The authorization snapshot carried in the run token (protocol §2). */
export interface Snapshot {
  /** Absolute host path under one of the daemon's `workspace.roots`. */
  workspace: string;
  read_only?: boolean;
  permission_mode: PermissionMode;
  /** Write tools already allowed for the session: no approval asked for them. */
  session_allowed?: string[];
  tools: ToolSpec[];
  limits?: SnapshotLimits;
}

const SNAPSHOT_KEYS = ["workspace", "read_only", "permission_mode", "session_allowed", "tools", "limits"];
const TOOL_KEYS = ["name", "class", "enabled", "input_schema", "frozen", "description"];
const LIMIT_KEYS = ["max_calls", "max_concurrency", "timeout_s", "memory_max_bytes", "tasks_max"];
const CLASSES = ["read", "write", "destructive", "long_task"];
const MODES = ["approval", "auto"];

function refuse(reason: string, field: string, message: string): never {
  throw new SnapshotError(`snapshot: ${field}: ${message}`, { reason, field });
}

function isObject(v: unknown): v is Record<string, unknown> {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

function checkKeys(obj: Record<string, unknown>, allowed: string[], prefix: string): void {
  for (const k of Object.keys(obj)) {
    if (!allowed.includes(k)) {
      refuse("unknown_field", prefix + k, `unknown field \`${k}\`, expected one of ${allowed.join(", ")}`);
    }
  }
}

function present(obj: Record<string, unknown>, key: string): boolean {
  return Object.prototype.hasOwnProperty.call(obj, key) && obj[key] !== undefined;
}

/**
 * Check a snapshot the way the daemon does before it is signed into a token, so a
 * mistake is found in the engine rather than as a refused `script.start`. Throws a
 * {@link ScriptgateError} with code -32011 and the daemon's `reason`/`field`
 * (`unknown_field`, `missing_field`, `invalid_value`, `duplicate_tool`,
 * `not_absolute`). What only the daemon can check (the workspace exists, lies under
 * its roots and is writable; schemas compile) is left to it.
 */
export function validateSnapshot(snapshot: unknown): asserts snapshot is Snapshot {
  if (!isObject(snapshot)) refuse("invalid_value", ".", "the snapshot must be a JSON object");
  const s = snapshot;
  checkKeys(s, SNAPSHOT_KEYS, "");
  for (const k of ["workspace", "permission_mode", "tools"]) {
    if (!present(s, k)) refuse("missing_field", k, `missing field \`${k}\``);
  }
  if (typeof s["workspace"] !== "string" || s["workspace"] === "") {
    refuse("invalid_value", "workspace", "must be a non-empty string");
  }
  if (!MODES.includes(s["permission_mode"] as string)) {
    refuse("invalid_value", "permission_mode", `must be one of ${MODES.join(", ")}`);
  }
  if (present(s, "read_only") && typeof s["read_only"] !== "boolean") {
    refuse("invalid_value", "read_only", "must be a boolean");
  }
  if (present(s, "session_allowed")) {
    const sa = s["session_allowed"];
    if (!Array.isArray(sa)) refuse("invalid_value", "session_allowed", "must be an array of tool names");
    sa.forEach((n, i) => {
      if (typeof n !== "string") refuse("invalid_value", `session_allowed[${i}]`, "must be a string");
    });
  }
  if (present(s, "limits")) {
    const l = s["limits"];
    if (!isObject(l)) refuse("invalid_value", "limits", "must be an object");
    checkKeys(l, LIMIT_KEYS, "limits.");
    for (const [k, v] of Object.entries(l)) {
      if (v === undefined) continue;
      if (typeof v !== "number" || !Number.isSafeInteger(v) || v < 0) {
        refuse("invalid_value", `limits.${k}`, "must be a non-negative integer");
      }
    }
  }
  const tools = s["tools"];
  if (!Array.isArray(tools)) refuse("invalid_value", "tools", "must be an array");
  const names = new Set<string>();
  tools.forEach((t: unknown, i: number) => {
    const at = `tools[${i}]`;
    if (!isObject(t)) refuse("invalid_value", at, "must be an object");
    checkKeys(t, TOOL_KEYS, `${at}.`);
    for (const k of ["name", "class"]) {
      if (!present(t, k)) refuse("missing_field", `${at}.${k}`, `missing field \`${k}\``);
    }
    const name = t["name"];
    if (
      typeof name !== "string" ||
      name.length === 0 ||
      Buffer.byteLength(name) > 128 ||
      /[\s\p{Cc}]/u.test(name)
    ) {
      refuse("invalid_value", `${at}.name`, "tool names must be 1..128 visible characters");
    }
    if (!CLASSES.includes(t["class"] as string)) {
      refuse("invalid_value", `${at}.class`, `must be one of ${CLASSES.join(", ")}`);
    }
    if (present(t, "enabled") && typeof t["enabled"] !== "boolean") {
      refuse("invalid_value", `${at}.enabled`, "must be a boolean");
    }
    if (present(t, "description") && typeof t["description"] !== "string") {
      refuse("invalid_value", `${at}.description`, "must be a string");
    }
    if (present(t, "frozen") && !isObject(t["frozen"])) {
      refuse("invalid_value", `${at}.frozen`, "must be an object");
    }
    const schema = t["input_schema"];
    const callable = t["enabled"] !== false && (t["class"] === "read" || t["class"] === "write");
    if (schema === undefined || schema === null) {
      if (callable) {
        refuse(
          "missing_field",
          `${at}.input_schema`,
          `tool ${name} can be called from a script and needs an input_schema`,
        );
      }
      if (schema === null) refuse("invalid_value", `${at}.input_schema`, "must be a JSON Schema, not null");
    } else if (!isObject(schema) && typeof schema !== "boolean") {
      refuse("invalid_schema", `${at}.input_schema`, "must be a JSON Schema (an object or a boolean)");
    }
    if (names.has(name)) refuse("duplicate_tool", `${at}.name`, `tool ${name} is listed twice`);
    names.add(name);
  });
  if (!isAbsolute(s["workspace"] as string)) {
    refuse("not_absolute", "workspace", "workspace must be an absolute path");
  }
}

/**
 * An MCP `Tool` as `tools/list` gives it (the MCP SDK's `Tool` type is assignable to
 * this). Only `name`, `description`, `inputSchema`, `annotations.readOnlyHint`,
 * `annotations.destructiveHint` and `execution.taskSupport` are read.
 */
export interface McpTool {
  name: string;
  description?: string | undefined;
  inputSchema?: { [key: string]: unknown } | undefined;
  annotations?: { readOnlyHint?: boolean | undefined; destructiveHint?: boolean | undefined; [key: string]: unknown } | undefined;
  execution?: { taskSupport?: string | undefined; [key: string]: unknown } | undefined;
  [key: string]: unknown;
}

export interface FromMcpOptions {
  /** The server's name: the prefix of the tool's name (`server__tool`). [A-Za-z0-9_-], no `__`. */
  server: string;
  /** Override the class the annotations give. */
  class?: ToolClass;
  enabled?: boolean;
  frozen?: { [key: string]: unknown };
}

const SERVER_NAME = /^[A-Za-z0-9_-]+$/;

/**
 * The snapshot entry of an MCP tool, as `scriptgate run` makes it
 * (tests/fixtures/mcp-tools.json): name `server__tool`; class `long_task` when
 * `execution.taskSupport` is `required`, else `read` when `readOnlyHint` is true,
 * else `write` when `destructiveHint` is false, else `destructive` (MCP's default
 * for `destructiveHint` is true); `input_schema` the tool's `inputSchema` (none: no
 * arguments, `{type: "object", properties: {}}`); `description` when the tool has one.
 * Throws a TypeError for a server name that is empty, has characters outside
 * [A-Za-z0-9_-] or contains `__`.
 */
export function toolFromMcp(tool: McpTool, options: FromMcpOptions): ToolSpec {
  const server = options.server;
  if (typeof server !== "string" || !SERVER_NAME.test(server) || server.includes("__")) {
    throw new TypeError(`toolFromMcp: server name ${JSON.stringify(server)} must be non-empty, of [A-Za-z0-9_-], without "__"`);
  }
  if (!isObject(tool) || typeof tool.name !== "string" || tool.name === "") {
    throw new TypeError("toolFromMcp: an MCP tool has a non-empty string name");
  }
  const a = isObject(tool.annotations) ? tool.annotations : {};
  let cls: ToolClass;
  if (isObject(tool.execution) && tool.execution["taskSupport"] === "required") cls = "long_task";
  else if (a["readOnlyHint"] === true) cls = "read";
  else if (a["destructiveHint"] === false) cls = "write";
  else cls = "destructive";
  const spec: ToolSpec = {
    name: `${server}__${tool.name}`,
    class: options.class ?? cls,
    enabled: options.enabled ?? true,
    input_schema: isObject(tool.inputSchema) ? tool.inputSchema : { type: "object", properties: {} },
  };
  if (typeof tool.description === "string") spec.description = tool.description;
  if (options.frozen !== undefined) spec.frozen = options.frozen;
  return spec;
}

/** `server__tool` back to its parts (the server name has no `__`); undefined when there is no `__`. */
export function splitToolName(name: string): { server: string; tool: string } | undefined {
  const i = name.indexOf("__");
  return i <= 0 ? undefined : { server: name.slice(0, i), tool: name.slice(i + 2) };
}
