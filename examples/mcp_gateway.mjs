// An MCP gateway on scriptgate: server-everything's tools (MCP SDK, stdio) become the snapshot, their results go back
// unchanged, a script runs with one approved write, then a running script is cancelled and its MCP call aborted.
// Usage: node examples/mcp_gateway.mjs [SOCKET] [KEY_FILE] [WORKSPACE_ROOT]. Setup: npm ci && npm run build in
// clients/typescript, then npm ci in examples (examples/package.json: the MCP SDK, server-everything, @scriptgate/client).
import { createRequire } from "node:module";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { ScriptgateClient, mintToken, prepareWorkspace, readKeyFile, toolFromMcp } from "@scriptgate/client";
const SCRIPT = `
import agent_tools
print(agent_tools.call("everything__echo", {"message": "hello from the sandbox"}))
print("sum", agent_tools.call("everything__get-sum", {"a": 2, "b": 40}))
print(agent_tools.call("everything__toggle-simulated-logging", {}))
`;
const [socket, keyFile = "/etc/scriptgate/token.key", root = "/var/lib/scriptgate/workspaces"] = process.argv.slice(2);
const mcp = new Client({ name: "mcp-gateway", version: "1.0.0" });
const everything = createRequire(import.meta.url).resolve("@modelcontextprotocol/server-everything/dist/index.js"); // its bin
await mcp.connect(new StdioClientTransport({ command: process.execPath, args: [everything], stderr: "ignore" }));
const tools = (await mcp.listTools()).tools.map((t) => toolFromMcp(t, { server: "everything" }));
const snapshot = { workspace: await prepareWorkspace(`${root}/gateway-${process.pid}`), permission_mode: "approval", tools };
const token = mintToken(readKeyFile(keyFile), `gateway-${process.pid}`, snapshot, 600, "examples/mcp_gateway.mjs");
let aborted; const wasAborted = new Promise((r) => (aborted = r));
const client = await ScriptgateClient.connect(socket, { // no SOCKET: $SCRIPTGATE_SOCKET, else /run/scriptgate/scriptgate.sock
  onApproval: ({ tools }) => (console.log(`approved ${tools.map((t) => t.name)}`), "allow_once"),
  onToolCall: ({ tool, arguments: args }, ctx) => mcp.callTool({ name: tool.slice("everything__".length), arguments: args }, undefined, ctx.requestOptions)
    .catch((e) => { if (ctx.signal.aborted) aborted(`${tool}: ${e.message}`); throw e; }),
});
const r = await client.run({ token, code: SCRIPT, tools: ["everything__toggle-simulated-logging"], description: "echo, add, toggle logging" });
console.log(r.text);
const { script_id } = await client.start({ token, code: `import agent_tools\nagent_tools.call("everything__trigger-long-running-operation", {"duration": 60, "steps": 60})` });
for await (const ev of client.progress(script_id)) if (ev.type === "call") break; // the MCP call is running: its first progress came
console.log(`cancel: ${(await client.cancel(script_id)).state}; MCP call aborted: ${await wasAborted}`);
process.exitCode = r.status === "ok" ? 0 : 1;
await Promise.all([client.close(), mcp.close()]);
