// The MCP TypeScript SDK v1 (@modelcontextprotocol/sdk 1.32.2) Client at its defaults
// (initialize: 2025-11-25) against `scriptgate mcp` over stdio: the 500-call summary, a
// failing script's error tail, a declared write approved through its elicitation
// handler and refused where the client declares no elicitation, and an aborted call
// whose script is recorded cancelled.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";
import { ElicitRequestSchema } from "@modelcontextprotocol/sdk/types.js";
import { SCRIPTGATE, h, mcpArgs, rebootArgs, textOf, unique, waitRecord } from "./lib.mjs";

const T = { timeout: 120_000 };

async function connect({ elicit } = {}) {
  const client = new Client({ name: "sdk-v1-host", version: "1.0.0" }, { capabilities: elicit ? { elicitation: {} } : {} });
  if (elicit) client.setRequestHandler(ElicitRequestSchema, (req) => elicit(req.params));
  await client.connect(new StdioClientTransport({ command: SCRIPTGATE, args: mcpArgs(), stderr: "ignore" }));
  return client;
}

test("the 500-call summary reaches the client", T, async () => {
  const c = await connect();
  try {
    assert.equal(c.getServerVersion().name, "scriptgate");
    const r = await c.callTool({ name: "run_script", arguments: { code: h.SUMMARY_CODE, description: unique("summary") } });
    assert.equal(r.isError, false, textOf(r));
    assert.ok(textOf(r).startsWith("run_script ok: 500 calls, 0 failed"), textOf(r));
    assert.ok(textOf(r).includes(h.summary), textOf(r));
    assert.equal(r.structuredContent.output, h.summary + "\n");
    assert.equal(r.structuredContent.calls, 500);
  } finally {
    await c.close();
  }
});

test("a failing script is an error result with its tail", T, async () => {
  const c = await connect();
  try {
    const r = await c.callTool({ name: "run_script", arguments: { code: h.FAIL_CODE, description: unique("fails") } });
    assert.equal(r.isError, true);
    assert.ok(textOf(r).includes(h.FAIL_OUTPUT) && textOf(r).includes(h.FAIL_TAIL), textOf(r));
    assert.ok(r.structuredContent.error.endsWith(h.FAIL_TAIL), r.structuredContent.error);
  } finally {
    await c.close();
  }
});

test("a declared write is approved through the elicitation handler", T, async () => {
  const asked = [];
  const c = await connect({
    elicit: (p) => {
      asked.push(p.message);
      return { action: "accept", content: { allow: true } };
    },
  });
  try {
    const r = await c.callTool({ name: "run_script", arguments: rebootArgs(unique("reboot")) });
    assert.equal(r.isError, false, textOf(r));
    assert.ok(textOf(r).includes(h.REBOOTED), textOf(r));
    assert.equal(asked.length, 1);
    assert.ok(asked[0].includes("fleet__reboot_device (write)"), asked[0]);
  } finally {
    await c.close();
  }
});

test("a client without elicitation is refused the write and told why", T, async () => {
  const c = await connect();
  try {
    const r = await c.callTool({ name: "run_script", arguments: rebootArgs(unique("no-elicitation")) });
    assert.equal(r.isError, true);
    assert.ok(textOf(r).includes(h.CANNOT_ASK) && textOf(r).includes("--mode auto"), textOf(r));
  } finally {
    await c.close();
  }
});

test("an aborted call leaves its script recorded cancelled", T, async () => {
  const c = await connect();
  try {
    const description = unique("cancel");
    const abort = new AbortController();
    let up;
    const running = new Promise((ok) => (up = ok));
    const call = c.callTool({ name: "run_script", arguments: { code: h.SLEEP_CODE, description } }, undefined, {
      signal: abort.signal,
      onprogress: () => up(),
    });
    await running;
    abort.abort();
    await assert.rejects(call);
    assert.equal((await waitRecord(description)).status, "cancelled");
  } finally {
    await c.close();
  }
});
