// Compiled with `tsc -p test` (no output): the published .d.ts as a consumer sees it.
import {
  ScriptgateClient,
  ScriptgateError,
  mintToken,
  validateSnapshot,
  type ApprovalHandler,
  type ScriptResult,
  type Snapshot,
  type ToolHandler,
} from "../dist/index.js";

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
void plain, mcp, wrong;

export async function engine(socket: string, key: Uint8Array, input: unknown): Promise<string> {
  validateSnapshot(input);
  const token = mintToken(key, "run-1", input, 600, "runner");
  const client = await ScriptgateClient.connect(socket, { onToolCall: plain, onApproval: approve });
  client.on("progress", (p) => console.log(p.progress?.done, p.progress?.total));
  // @ts-expect-error: the events are typed
  client.on("progress", (p) => p.bogus);
  client.on("finished", (r: ScriptResult) => console.log(r.status));
  try {
    const r = await client.run({ token, code: "print(1)", tools: [] }, { timeoutS: 30 });
    return r.text;
  } catch (e) {
    if (e instanceof ScriptgateError) return `${e.code} ${e.reason ?? ""} ${e.field ?? ""} ${e.tool ?? ""}`;
    throw e;
  } finally {
    await client.close();
  }
}
void snapshot;
