// `scriptgate mcp` driven by the official MCP TypeScript SDK's Client over stdio, with
// server-everything (TypeScript) as the upstream server: the run_script tool, 200 calls
// through call_many with progress and the summary text, a declared write approved through
// elicitation and the next denied, and an aborted call that cancels its script while an
// upstream call is in flight.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { MCP_MODULES, missing, sdk } from "./mcp-rig.mjs";

const SCRIPTGATE = process.env.SCRIPTGATE || fileURLToPath(new URL("../../../target/debug/scriptgate", import.meta.url));
const EVERYTHING = `${MCP_MODULES}@modelcontextprotocol/server-everything/dist/index.js`;
const skip = missing ?? (!existsSync(SCRIPTGATE) && `no ${SCRIPTGATE}: run cargo build`);
const T = { timeout: 120_000, skip };
const types = skip ? null : await import(new URL("@modelcontextprotocol/sdk/dist/esm/types.js", `file://${MCP_MODULES}`).href);

/** A connected SDK Client of `scriptgate mcp --embedded` over server-everything. */
async function codeMode({ elicit, extra = [] } = {}) {
  const client = new sdk.Client({ name: "scriptgate-mcp-test", version: "1.0.0" }, { capabilities: elicit ? { elicitation: {} } : {} });
  if (elicit) client.setRequestHandler(types.ElicitRequestSchema, (req) => elicit(req.params));
  await client.connect(
    new sdk.StdioClientTransport({ command: SCRIPTGATE, args: ["mcp", "--embedded", "--mcp", `everything=${process.execPath} ${EVERYTHING} stdio`, ...extra], stderr: "ignore" }),
  );
  return client;
}

/**
 * `scriptgate mcp --http 127.0.0.1:0` with a state directory of its own (its records and
 * its bearer token), and an SDK Client over Streamable HTTP that sends the token.
 */
async function codeModeHttp({ elicit } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "sg-mcp-http-"));
  chmodSync(dir, 0o755); // scripts run as nobody when this is root
  const config = join(dir, "scriptgate.toml");
  writeFileSync(config, `[state]\ndir = "${join(dir, "state")}"\n`);
  const child = spawn(SCRIPTGATE, ["mcp", "--embedded", "--config", config, "--http", "127.0.0.1:0", "--mcp", `everything=${process.execPath} ${EVERYTHING} stdio`], {
    stdio: ["ignore", "ignore", "pipe"],
  });
  let err = "";
  const [url, token] = await new Promise((resolve, reject) => {
    child.stderr.on("data", (d) => {
      err += d;
      const u = /Streamable HTTP at (http:\/\/\S+)/.exec(err);
      const t = /"Authorization: Bearer (\S+)"/.exec(err);
      if (u && t) resolve([u[1], t[1]]);
    });
    child.on("exit", (code) => reject(new Error(`scriptgate mcp exited ${code}: ${err}`)));
  });
  const auth = { authorization: `Bearer ${token}` };
  const { StreamableHTTPClientTransport } = await import(new URL("@modelcontextprotocol/sdk/dist/esm/client/streamableHttp.js", `file://${MCP_MODULES}`).href);
  const client = new sdk.Client({ name: "scriptgate-mcp-http-test", version: "1.0.0" }, { capabilities: elicit ? { elicitation: {} } : {} });
  if (elicit) client.setRequestHandler(types.ElicitRequestSchema, (req) => elicit(req.params));
  await client.connect(new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers: auth } }));
  const stop = async () => {
    await client.close();
    child.kill("SIGTERM");
    await new Promise((resolve) => (child.exitCode === null ? child.on("exit", resolve) : resolve()));
    rmSync(dir, { recursive: true, force: true });
  };
  return { client, url, auth, stop };
}

const textOf = (r) => r.content.filter((c) => c.type === "text").map((c) => c.text).join("");

/**
 * Every message the client receives, in arrival order, recorded before the SDK
 * dispatches it. The SDK (1.32) runs a notification's handler in a microtask and a
 * response's at once, so a progress notification read in the same chunk as the
 * response is dropped as "an unknown token" (modelcontextprotocol/typescript-sdk#2580,
 * open). The final state is therefore asserted on the wire, where the server decides it.
 */
function recordWire(client) {
  const wire = [];
  const transport = client.transport;
  const dispatch = transport.onmessage;
  transport.onmessage = (msg, extra) => {
    wire.push(msg);
    dispatch?.(msg, extra);
  };
  return wire;
}

/**
 * The progress the server sent for the call answered with `calls` calls: all of it came
 * before that answer, its last is `final`, and the SDK delivered (`seen`) all of it
 * except, at most, that last one (the race above).
 */
function assertProgressBeforeResult(wire, seen, calls, final) {
  const at = wire.findIndex((m) => m.result?.structuredContent?.calls === calls);
  assert.ok(at >= 0, "the answer is on the wire");
  const ofCall = (m) => m.method === "notifications/progress" && m.params.progressToken === wire[at].id;
  assert.equal(wire.slice(at).filter(ofCall).length, 0, "no progress after the answer");
  const sent = wire.slice(0, at).filter(ofCall).map((m) => m.params.message);
  assert.equal(sent.at(-1), final, JSON.stringify(sent));
  const got = seen.map((p) => p.message);
  assert.ok(got.length >= sent.length - 1, JSON.stringify({ sent, got }));
  assert.deepEqual(got, sent.slice(0, got.length));
}

test("run_script: 200 calls through call_many, progress, the summary text and structuredContent", T, async () => {
  const client = await codeMode();
  try {
    const { tools } = await client.listTools();
    assert.deepEqual(tools.map((t) => t.name), ["run_script"]);
    assert.match(tools[0].description, /everything__get-sum/);
    const seen = [];
    const wire = recordWire(client);
    // 100 through call_many, 100 through the typed API (get-sum is spelled get_sum).
    const code = [
      "import agent_tools",
      "from agent_tools import tools",
      "sums = agent_tools.call_many('everything__get-sum', [{'a': i, 'b': 1} for i in range(100)])",
      "sums += tools.everything.get_sum.many([{'a': i, 'b': 1} for i in range(100, 200)])",
      "print(len(sums), 'sums')",
    ].join("\n");
    const r = await client.callTool({ name: "run_script", arguments: { code, description: "200 sums" } }, undefined, {
      onprogress: (p) => seen.push(p),
      timeout: 100_000,
    });
    assert.equal(r.isError, false, textOf(r));
    assert.match(textOf(r), /^run_script ok: 200 calls, 0 failed, /);
    assert.match(textOf(r), /200 sums/);
    assert.equal(r.structuredContent.status, "ok");
    assert.equal(r.structuredContent.calls, 200);
    assertProgressBeforeResult(wire, seen, 200, "ok: 200 calls, 0 failed");
  } finally {
    await client.close();
  }
});

test("elicitation: one declared write approved, the next denied; the user sees the script", T, async () => {
  const asked = [];
  const client = await codeMode({
    elicit: (params) => {
      asked.push(params);
      return asked.length === 1 ? { action: "accept", content: { allow: true } } : { action: "decline" };
    },
  });
  try {
    const args = {
      code: "import agent_tools\nprint(agent_tools.call('everything__toggle-simulated-logging', {}))",
      tools: ["everything__toggle-simulated-logging"],
      description: "toggle logging",
    };
    const ok = await client.callTool({ name: "run_script", arguments: args });
    assert.equal(ok.isError, false, textOf(ok));
    assert.equal(ok.structuredContent.calls, 1);
    const denied = await client.callTool({ name: "run_script", arguments: args });
    assert.equal(denied.isError, true);
    assert.equal(denied.structuredContent.status, "refused");
    assert.match(textOf(denied), /denied/i);
    assert.equal(asked.length, 2);
    assert.match(asked[0].message, /everything__toggle-simulated-logging \(write\)/);
    assert.match(asked[0].message, /toggle logging/);
  } finally {
    await client.close();
  }
});

test("an aborted call cancels its script, with an upstream call in flight", T, async () => {
  const client = await codeMode();
  try {
    const code = [
      "import agent_tools",
      "agent_tools.progress(1, 2, 'calling')",
      "agent_tools.call('everything__trigger-long-running-operation', {'duration': 600, 'steps': 2})",
    ].join("\n");
    const abort = new AbortController();
    const description = `cancel-${process.pid}-${Date.now()}`;
    const call = client.callTool({ name: "run_script", arguments: { code, description } }, undefined, {
      signal: abort.signal,
      onprogress: () => abort.abort(),
      timeout: 100_000,
    });
    await assert.rejects(call, /abort/i);
    // The session goes on: the next script runs.
    const next = await client.callTool({ name: "run_script", arguments: { code: "print('after')", description: "after" } });
    assert.match(textOf(next), /^run_script ok: 0 calls/);
    // The cancelled script's record (the embedded daemon's store): cancelled.
    const state = process.getuid() === 0 ? "/var/lib/scriptgate/cli" : `${process.env.HOME}/.local/state/scriptgate`;
    const dir = mkdtempSync(join(tmpdir(), "sg-mcp-"));
    writeFileSync(join(dir, "c.toml"), `[state]\ndir = ${JSON.stringify(state)}\n`);
    const rows = JSON.parse(
      execFileSync(SCRIPTGATE, ["audit", "--json", "--config", join(dir, "c.toml"), "--socket", join(dir, "none")], { encoding: "utf8" }),
    );
    rmSync(dir, { recursive: true, force: true });
    const mine = (Array.isArray(rows) ? rows : rows.scripts).filter((r) => r.description === description);
    assert.equal(mine.length, 1, JSON.stringify(rows).slice(0, 500));
    assert.equal(mine[0].status, "cancelled");
  } finally {
    await client.close();
  }
});

test("--http: Streamable HTTP with the SDK's client: 200 calls with progress, an approval, a cancel; a foreign Origin is refused; no token, no service", T, async () => {
  const asked = [];
  const { client, url, auth, stop } = await codeModeHttp({
    elicit: (params) => {
      asked.push(params);
      return { action: "accept", content: { allow: true } };
    },
  });
  try {
    assert.deepEqual((await client.listTools()).tools.map((t) => t.name), ["run_script"]);
    const seen = [];
    const wire = recordWire(client);
    const code = "import agent_tools\nsums = agent_tools.call_many('everything__get-sum', [{'a': i, 'b': 1} for i in range(200)])\nprint(len(sums))";
    const r = await client.callTool({ name: "run_script", arguments: { code, description: "200 sums over http" } }, undefined, {
      onprogress: (p) => seen.push(p),
      timeout: 100_000,
    });
    assert.equal(r.isError, false, textOf(r));
    assert.equal(r.structuredContent.calls, 200);
    assertProgressBeforeResult(wire, seen, 200, "ok: 200 calls, 0 failed");
    const w = await client.callTool({
      name: "run_script",
      arguments: { code: "import agent_tools\nagent_tools.call('everything__toggle-simulated-logging', {})", tools: ["everything__toggle-simulated-logging"], description: "toggle" },
    });
    assert.equal(w.isError, false, textOf(w));
    assert.equal(asked.length, 1);
    const abort = new AbortController();
    const slow = client.callTool(
      { name: "run_script", arguments: { code: "import agent_tools, time\nagent_tools.progress(1, 2, 'waiting')\ntime.sleep(600)", description: "wait" } },
      undefined,
      { signal: abort.signal, onprogress: () => abort.abort(), timeout: 100_000 },
    );
    await assert.rejects(slow, /abort/i);
    // A browser page elsewhere (DNS rebinding) is refused; a client without Origin is served.
    const init = { jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "x", version: "1" } } };
    const post = (headers) =>
      fetch(url, { method: "POST", headers: { "content-type": "application/json", accept: "application/json, text/event-stream", ...headers }, body: JSON.stringify(init) });
    assert.equal((await post({ ...auth, origin: "http://evil.example" })).status, 403);
    assert.equal((await post(auth)).status, 200);
    // Without the bearer token, or with another: 401.
    assert.equal((await post({})).status, 401);
    assert.equal((await post({ authorization: "Bearer not-the-token" })).status, 401);
  } finally {
    await stop();
  }
});

const INSPECTOR = fileURLToPath(new URL("../../../tests/inspector/node_modules/.bin/mcp-inspector", import.meta.url));

test("the MCP Inspector's CLI lists run_script and calls it", { timeout: 120_000, skip: skip || (!existsSync(INSPECTOR) && "no MCP Inspector in tests/inspector (tools/install-deps)") }, () => {
  const dir = mkdtempSync(join(tmpdir(), "sg-inspector-"));
  try {
    const inspect = (...args) =>
      JSON.parse(
        execFileSync(INSPECTOR, ["--cli", SCRIPTGATE, "mcp", "--embedded", "--mcp", `everything=${process.execPath} ${EVERYTHING} stdio`, ...args], {
          encoding: "utf8",
          env: { ...process.env, MCP_CATALOG_PATH: join(dir, "catalog.json") },
          stdio: ["ignore", "pipe", "pipe"],
          timeout: 100_000,
        }),
      );
    const listed = inspect("--method", "tools/list");
    assert.deepEqual(listed.tools.map((t) => t.name), ["run_script"]);
    const code = "from agent_tools import tools\nprint(tools.everything.get_sum(a=40, b=2))";
    const r = inspect("--method", "tools/call", "--tool-name", "run_script", "--tool-arg", `code=${code}`, "--tool-arg", "description=inspector");
    assert.equal(r.isError, false, JSON.stringify(r));
    assert.match(r.content[0].text, /^run_script ok: 1 calls, 0 failed/);
    assert.match(r.content[0].text, /42/);
    assert.equal(r.structuredContent.status, "ok");
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("--http: at most 32 sessions at once; ending one (DELETE) makes room", T, async () => {
  const { client, url, auth, stop } = await codeModeHttp();
  try {
    const init = { jsonrpc: "2.0", id: 1, method: "initialize", params: { protocolVersion: "2025-06-18", capabilities: {}, clientInfo: { name: "x", version: "1" } } };
    const headers = { "content-type": "application/json", accept: "application/json, text/event-stream", ...auth };
    const open = () => fetch(url, { method: "POST", headers, body: JSON.stringify(init) });
    // The SDK client holds one; 31 more fill the bound.
    const ids = [];
    for (let i = 0; i < 31; i++) {
      const r = await open();
      assert.equal(r.status, 200, `session ${i + 2}`);
      ids.push(r.headers.get("mcp-session-id"));
      await r.body?.cancel();
    }
    const over = await open();
    assert.notEqual(over.status, 200);
    assert.match(await over.text(), /too many MCP sessions at once \(at most 32\)/);
    const end = await fetch(url, { method: "DELETE", headers: { "mcp-session-id": ids[0], ...auth } });
    assert.ok(end.status < 300, `DELETE: ${end.status}`);
    const again = await open();
    assert.equal(again.status, 200);
    await again.body?.cancel();
    // The first client's session still works.
    assert.deepEqual((await client.listTools()).tools.map((t) => t.name), ["run_script"]);
  } finally {
    await stop();
  }
});
