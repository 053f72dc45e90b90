// A real MCP server (server-everything, over stdio) through the official MCP SDK, as
// tools/install-deps installs them into tests/mcp. `sdk` is null (with `missing`
// saying why) when they are not installed, and the tests that need them skip.
import { existsSync } from "node:fs";
import { fileURLToPath } from "node:url";

const mcpModules = new URL("../../../tests/mcp/node_modules/", import.meta.url);
export const MCP_MODULES = fileURLToPath(mcpModules);
const everything = fileURLToPath(new URL("@modelcontextprotocol/server-everything/dist/index.js", mcpModules));
const sdkClient = new URL("@modelcontextprotocol/sdk/dist/esm/client/index.js", mcpModules);
const sdkStdio = new URL("@modelcontextprotocol/sdk/dist/esm/client/stdio.js", mcpModules);

export const missing = !existsSync(fileURLToPath(sdkClient))
  ? `no MCP SDK in ${MCP_MODULES} (tools/install-deps: npm ci in tests/mcp)`
  : !existsSync(everything)
    ? `no server-everything in ${MCP_MODULES} (tools/install-deps)`
    : undefined;

export const sdk = missing ? null : { ...(await import(sdkClient.href)), ...(await import(sdkStdio.href)) };

/** A connected SDK Client of a fresh server-everything. */
export async function everythingClient() {
  const mcp = new sdk.Client({ name: "scriptgate-ts-test", version: "1.0.0" });
  await mcp.connect(new sdk.StdioClientTransport({ command: process.execPath, args: [everything, "stdio"], stderr: "ignore" }));
  return mcp;
}

/** Import a module installed in tests/mcp (e.g. "@opentelemetry/sdk-trace-base"), or null. */
export async function importTestModule(name) {
  const pkg = new URL(`${name}/package.json`, mcpModules);
  if (!existsSync(fileURLToPath(pkg))) return null;
  const { createRequire } = await import("node:module");
  const req = createRequire(fileURLToPath(pkg));
  return import(new URL(`file://${req.resolve(name)}`).href);
}
