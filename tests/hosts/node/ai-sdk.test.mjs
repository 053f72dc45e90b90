// The AI SDK's MCP client (@ai-sdk/mcp 2.0.99, its stdio transport, at its defaults:
// server/discover, 2026-07-28, within 1 s, else initialize) against `scriptgate mcp`, its tools in generateText
// (ai 7) with a mock model (ai/test's MockLanguageModelV4: no provider) that calls
// run_script once and keeps the tool result the AI SDK hands it back. Also: a declared
// write approved through onElicitationRequest (an input_required result in 2026-07-28)
// and refused without it, and an aborted generateText: the AI SDK sends no
// notifications/cancelled, so the script runs on until the client closes, which
// cancels it (the record says so).
import { test } from "node:test";
import assert from "node:assert/strict";
import { createMCPClient, ElicitationRequestSchema } from "@ai-sdk/mcp";
import { StdioMCPTransport } from "@ai-sdk/mcp/mcp-stdio";
import { generateText, isStepCount } from "ai";
import { MockLanguageModelV4 } from "ai/test";
import { SCRIPTGATE, h, mcpArgs, rebootArgs, unique, waitRecord, record } from "./lib.mjs";

const T = { timeout: 120_000 };
const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 1, text: 1, reasoning: 0 } };

/** A model that calls run_script with `args`, then says "done"; `results` is what it was handed. */
function scripted(args) {
  const seen = { offered: [], results: [] };
  seen.model = new MockLanguageModelV4({
    doGenerate: async (options) => {
      const back = options.prompt.filter((m) => m.role === "tool").flatMap((m) => m.content).filter((p) => p.type === "tool-result");
      if (back.length) {
        seen.results = back;
        return { content: [{ type: "text", text: "done" }], finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
      }
      seen.offered = (options.tools ?? []).map((t) => t.name);
      return {
        content: [{ type: "tool-call", toolCallId: "call-1", toolName: "run_script", input: JSON.stringify(args) }],
        finishReason: { unified: "tool-calls", raw: "tool_calls" },
        usage,
        warnings: [],
      };
    },
  });
  /** The tool result's text, as the model gets it. */
  seen.text = () => {
    assert.equal(seen.results.length, 1, JSON.stringify(seen.results));
    const out = seen.results[0].output;
    return JSON.stringify(out);
  };
  return seen;
}

/**
 * The AI SDK's MCP client; `sent` gets every message it writes. The era it speaks is
 * a test's diagnostic line: its stdio transport gives server/discover 1 s, then falls
 * back to initialize (2025-11-25), and scriptgate mcp answers only once its upstream
 * servers and embedded daemon have started (see the era test below).
 */
async function connect(t, { elicit, sent = [] } = {}) {
  const transport = new StdioMCPTransport({ command: SCRIPTGATE, args: mcpArgs(), stderr: "ignore" });
  const send = transport.send.bind(transport);
  transport.send = (m) => {
    sent.push({ ...m, at: performance.now() });
    return send(m);
  };
  const client = await createMCPClient({ transport, ...(elicit ? { capabilities: { elicitation: {} } } : {}) });
  if (elicit) client.onElicitationRequest(ElicitationRequestSchema, (req) => elicit(req.params));
  t.diagnostic(`the AI SDK speaks ${client.initializeResult.protocolVersion}`);
  return client;
}

test("at its defaults the AI SDK speaks 2026-07-28 to scriptgate mcp", T, async (t) => {
  const sent = [];
  const c = await connect(t, { sent });
  try {
    const era = c.initializeResult.protocolVersion;
    const discover = sent.find((m) => m.method === "server/discover");
    const initialize = sent.find((m) => m.method === "initialize");
    assert.ok(discover, "the AI SDK probes server/discover first");
    // (The AI SDK starts its 1 s before it writes the request: 900 ms leaves room for that.)
    if (era !== "2026-07-28" && initialize && initialize.at - discover.at >= 900) {
      // Not scriptgate's answer: none came within the AI SDK's 1 s.
      t.skip(`server/discover went unanswered for the AI SDK's 1 s (scriptgate mcp was still starting its upstream ` +
        `servers and embedded daemon on this loaded machine), so it fell back to initialize (${era})`);
      return;
    }
    assert.equal(era, "2026-07-28");
    assert.equal(initialize, undefined);
  } finally {
    await c.close();
  }
});

async function run(seen, client, abortSignal) {
  return generateText({ model: seen.model, tools: await client.tools(), prompt: "check the fleet", stopWhen: isStepCount(2), abortSignal });
}

test("the model is handed the 500-call summary", T, async (t) => {
  const c = await connect(t);
  try {
    const seen = scripted({ code: h.SUMMARY_CODE, description: unique("summary") });
    const r = await run(seen, c);
    assert.equal(r.text, "done");
    assert.deepEqual(seen.offered, ["run_script"]);
    assert.ok(seen.text().includes(JSON.stringify(h.summary).slice(1, -1)), seen.text());
    assert.ok(seen.text().includes("run_script ok: 500 calls, 0 failed"), seen.text());
  } finally {
    await c.close();
  }
});

test("the model is handed a failing script's output and error tail", T, async (t) => {
  const c = await connect(t);
  try {
    const seen = scripted({ code: h.FAIL_CODE, description: unique("fails") });
    await run(seen, c);
    assert.ok(seen.text().includes(h.FAIL_OUTPUT) && seen.text().includes(h.FAIL_TAIL), seen.text());
  } finally {
    await c.close();
  }
});

test("a declared write is approved through onElicitationRequest", T, async (t) => {
  const asked = [];
  const c = await connect(t, {
    elicit: (p) => {
      asked.push(p.message);
      return { action: "accept", content: { allow: true } };
    },
  });
  try {
    const seen = scripted(rebootArgs(unique("reboot")));
    await run(seen, c);
    assert.equal(asked.length, 1);
    assert.ok(asked[0].includes("fleet__reboot_device (write)"), asked[0]);
    assert.ok(seen.text().includes(JSON.stringify(h.REBOOTED).slice(1, -1)), seen.text());
  } finally {
    await c.close();
  }
});

test("without an elicitation handler the model is told the write was refused and why", T, async (t) => {
  const c = await connect(t);
  try {
    const seen = scripted(rebootArgs(unique("no-elicitation")));
    await run(seen, c);
    assert.ok(seen.text().includes(h.CANNOT_ASK), seen.text());
  } finally {
    await c.close();
  }
});

test("an aborted run: the script runs on until the client closes, then is recorded cancelled", T, async (t) => {
  const sent = [];
  const c = await connect(t, { sent });
  const description = unique("cancel");
  const abort = new AbortController();
  const seen = scripted({ code: h.SLEEP_CODE, description });
  const r = run(seen, c, abort.signal);
  await waitRecord(description, { running: true });
  abort.abort();
  await assert.rejects(r);
  // The AI SDK sends no notifications/cancelled: the script still runs.
  assert.deepEqual(sent.filter((m) => m.method === "notifications/cancelled"), []);
  assert.equal(record(description).status, "running");
  await c.close();
  assert.equal((await waitRecord(description)).status, "cancelled");
});
