// Compiled with `tsc -p test` (no output): the published .d.ts as a consumer sees it.
import {
  ScriptgateClient,
  ScriptgateError,
  TokenError,
  ConnectionError,
  DaemonError,
  mintToken,
  prepareWorkspace,
  toolFromMcp,
  validateSnapshot,
  type ApprovalHandler,
  type ProgressEvent,
  type ScriptResult,
  type Snapshot,
  type ToolHandler,
  type ToolSpec,
} from "../dist/index.js";
// The official MCP SDK's types, from the test servers' install (tools/install-deps).
import type { Client } from "../../../tests/mcp/node_modules/@modelcontextprotocol/sdk/dist/esm/client/index.js";

const snapshot: Snapshot = {
  workspace: "/srv/ws/run-1",
  permission_mode: "approval",
  tools: [
    { name: "fleet__get_device_status", class: "read", input_schema: { type: "object" } },
    { name: "fleet__wipe_device", class: "destructive" },
  ],
  limits: { timeout_s: 60 },
};
// @ts-expect-error: not a tool class
const badClass: Snapshot = { workspace: "/w", permission_mode: "auto", tools: [{ name: "x", class: "admin" }] };
// @ts-expect-error: unknown snapshot field
const badField: Snapshot = { workspace: "/w", permission_mode: "auto", tools: [], extra: 1 };
void badClass, badField;

const plain: ToolHandler = (call) => ({ text: call.tool, structured: call.arguments, is_error: false });
const mcp: ToolHandler = async () => ({ content: [{ type: "text", text: "hi" }], isError: true });
// @ts-expect-error: neither answer shape
const wrong: ToolHandler = () => ({ foo: 1 });
const approve: ApprovalHandler = (req) => req.tools.every((t) => t.class === "write");
// @ts-expect-error: a plain answer is exact (is_error is required)
const noFlag: ToolHandler = () => ({ text: "x" });
const str: ToolHandler = () => "just text";
void plain, mcp, wrong, noFlag, str;

// The SDK's callTool() result is a handler's answer as it is (no cast), and
// context.requestOptions is the SDK's RequestOptions (signal, onprogress).
declare const sdk: Client;
type SdkCallResult = Awaited<ReturnType<Client["callTool"]>>;
const passThrough: ToolHandler = (call, context) => sdk.callTool({ name: call.tool, arguments: call.arguments }, undefined, context.requestOptions);
const viaType = (r: SdkCallResult): ReturnType<ToolHandler> => r;
void passThrough, viaType;

// The SDK's Tool (from listTools) goes through toolFromMcp, never as it is.
type SdkTool = Awaited<ReturnType<Client["listTools"]>>["tools"][number];
declare const sdkTool: SdkTool;
const mapped: ToolSpec = toolFromMcp(sdkTool, { server: "everything" });
// @ts-expect-error: an MCP tool spread into a snapshot tool keeps inputSchema/annotations, which the daemon refuses
const spread: ToolSpec = { ...sdkTool, class: "read" };
const described: ToolSpec = { name: "a__b", class: "read", input_schema: {}, description: "what the model reads" };
void mapped, spread, described;

async function follow(client: ScriptgateClient, id: string): Promise<number> {
  let n = 0;
  for await (const ev of client.progress(id) as AsyncIterable<ProgressEvent>) {
    if (ev.type === "call") n += ev.progress + (ev.total ?? 0) + ev.call_id.length;
    else n += ev.calls + (ev.progress?.done ?? 0);
  }
  return n;
}
void follow;
const typed = (e: unknown) => (e instanceof TokenError ? e.reason : e instanceof ConnectionError ? e.path : undefined);
const code = (e: DaemonError): number => e.code; // an error answer always has its code
void typed, code;
const workspace: Promise<string> = prepareWorkspace("/srv/ws/run-1");
// @ts-expect-error: prepareWorkspace is asynchronous
const workspaceNow: string = prepareWorkspace("/srv/ws/run-1");
void workspace, workspaceNow;

export async function engine(socket: string, key: Uint8Array, input: unknown): Promise<string> {
  validateSnapshot(input);
  const token = mintToken(key, "run-1", input, 600, "runner");
  const client = await ScriptgateClient.connect(socket, { onToolCall: plain, onApproval: approve });
  client.on("progress", (p) => console.log(p.progress?.done, p.progress?.total));
  // @ts-expect-error: the events are typed
  client.on("progress", (p) => p.bogus);
  client.on("finished", (r: ScriptResult) => console.log(r.status));
  try {
    const r = await client.run({ token, code: "print(1)", tools: [] }, { timeoutS: 30, signal: AbortSignal.timeout(60_000) });
    return r.text;
  } catch (e) {
    if (e instanceof ScriptgateError) return `${e.code} ${e.reason ?? ""} ${e.field ?? ""} ${e.tool ?? ""}`;
    throw e;
  } finally {
    await client.close();
  }
}
void snapshot;
